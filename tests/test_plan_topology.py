import itertools
import random

import pytest

from lins_ds.plan import Factor, Layout, PlanError, Topology, candidates, check_layout
from lins_ds.plan.layout import GROUP_KINDS, all_groups, chunks, group_mesh
from helpers import brute_force_candidates
from lins_ds.plan.topology import state_factors

SMALL = [Topology(m, l) for m in (1, 2, 3, 4, 6) for l in (1, 2, 3, 4, 6, 8)]


@pytest.mark.parametrize("topo", SMALL, ids=str)
def test_candidates_equal_brute_force(topo):
    assert candidates(topo) == sorted(set(brute_force_candidates(topo)))


def test_two_nodes_of_two_have_ten_plans():
    assert len(candidates(Topology(2, 2))) == 10


def test_paper_cluster_candidate_count_is_small():
    assert len(candidates(Topology(128, 8))) < 1000


@pytest.mark.parametrize("topo", SMALL, ids=str)
def test_every_candidate_obeys_the_rules(topo):
    L, M = topo.gpus_per_node, topo.nodes
    for lay in candidates(topo):
        for f in lay.factors().values():
            assert L % f.intra == 0 and M % f.inter == 0
            assert f.inter == 1 or f.intra == L  # fill the node before crossing it
        assert lay.p.divides(lay.g) and lay.g.divides(lay.os)
        assert lay.p.size <= lay.g.size <= lay.os.size <= topo.world_size


@pytest.mark.parametrize(
    "layout,message",
    [
        (Layout(Factor(3, 1), Factor(4, 1), Factor(4, 1)), "intra factor 3 does not divide gpus_per_node 4"),
        (Layout(Factor(1, 1), Factor(2, 2), Factor(4, 2)), "crosses nodes without filling one"),
        (Layout(Factor(4, 1), Factor(2, 1), Factor(4, 1)), "must divide lins.plan.g"),
        (Layout(Factor(1, 1), Factor(1, 1), Factor(4, 3)), "inter factor 3 does not divide nodes 2"),
    ],
)
def test_invalid_layouts_name_the_rule(layout, message):
    with pytest.raises(PlanError, match=message):
        check_layout(Topology(2, 4), layout)


def test_state_factors_prefiltered():
    assert state_factors(Topology(2, 4)) == [Factor(1, 1), Factor(2, 1), Factor(4, 1), Factor(4, 2)]


def _node(topo, r):
    return r // topo.gpus_per_node


@pytest.mark.parametrize("topo", [Topology(m, l) for m in (1, 2, 3, 4) for l in (1, 2, 4, 6)], ids=str)
def test_layout_invariants_exhaustive(topo):
    for lay in candidates(topo):
        s_p, s_g, s_os = lay.sharding()
        ch = [chunks(topo, lay, r) for r in range(topo.world_size)]
        for c in ch:  # nesting: c_os inside c_g inside c_p
            assert c.os // (s_os // s_g) == c.g and c.g // (s_g // s_p) == c.p
        for kind in GROUP_KINDS:
            groups = all_groups(topo, lay, kind)
            flat = sorted(itertools.chain.from_iterable(groups))
            assert flat == list(range(topo.world_size)), "groups must partition the world"
            mesh = group_mesh(topo, lay, kind)
            for g in groups:
                nodes = {_node(topo, r) for r in g}
                assert len(g) == mesh.size and len(nodes) == mesh.inter
                assert all(sum(_node(topo, r) == n for r in g) == mesh.intra for n in nodes)
        for g in all_groups(topo, lay, "p"):
            assert [ch[r].p for r in g] == list(range(s_p))
        for g in all_groups(topo, lay, "g"):
            assert [ch[r].g for r in g] == list(range(s_g))
        for g in all_groups(topo, lay, "g_replica"):
            assert len({ch[r].g for r in g}) == 1
        for g in all_groups(topo, lay, "p_sync"):  # OS chunks tile the P chunk, in order
            per = s_os // s_p
            assert len({ch[r].p for r in g}) == 1
            assert [ch[r].os for r in g] == [ch[g[0]].p * per + k for k in range(per)]


def test_layout_interleaves_when_g_crosses_nodes():
    # P = 2x1 inside a node, G = 2x2 across nodes: G-group order is not global-rank order.
    topo = Topology(2, 2)
    lay = Layout(Factor(2, 1), Factor(2, 2), Factor(2, 2))
    assert all_groups(topo, lay, "g") == ((0, 2, 1, 3),)


def test_random_large_topologies_layout_is_consistent():
    rng = random.Random(0)
    for _ in range(20):
        topo = Topology(rng.choice([8, 16]), rng.choice([4, 8]))
        lay = rng.choice(candidates(topo))
        s_p, s_g, s_os = lay.sharding()
        for r in rng.sample(range(topo.world_size), 16):
            c = chunks(topo, lay, r)
            assert 0 <= c.p < s_p and 0 <= c.g < s_g and 0 <= c.os < s_os


def test_unsorted_groups_only_when_both_dimensions_split():
    from lins_ds.plan.layout import needs_unsorted_groups

    for topo in (Topology(1, 4), Topology(4, 1), Topology(2, 2)):
        flags = [needs_unsorted_groups(topo, lay) for lay in candidates(topo)]
        assert any(flags) == (topo.nodes > 1 and topo.gpus_per_node > 1)
