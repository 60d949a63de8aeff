"""Makes a DeepSpeed config's ``"lins"`` block the switch: installed with lins_ds as ``lins_ds_autoload.pth``, which
the interpreter runs at start-up, so that any program that imports deepspeed (``deepspeed train.py``, torchrun,
``accelerate launch``, the HF Trainer) builds a LinsEngine for a config with a ``lins`` block, with no change to
the program. Standard library only, and nothing imported until the program itself imports deepspeed, accelerate's
state or transformers' models: then lins_ds patches them (lins_ds/__init__.py lists what each patch does).

``LINS_DS_AUTOLOAD=0`` turns Lins off for programs that do not ``import lins_ds`` themselves: a config with a
``lins`` block then trains under plain DeepSpeed, and says so loudly. ``import lins_ds`` (or ``python -m
lins_ds.run``) turns it on whatever the variable says.
"""

import os
import sys

ENV = "LINS_DS_AUTOLOAD"
WATCHED = ("deepspeed", "accelerate.state", "transformers.modeling_utils", "transformers.training_args",
           "peft.tuners.tuners_utils")

explicit = False  # the program imported lins_ds itself
importing = False  # this hook is importing lins_ds (so that import is not the program's)


def autoload_on() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def lins_on() -> bool:
    """Whether a ``lins`` block builds a LinsEngine in this process."""
    return explicit or autoload_on()


class _PatchOnImport:
    """A meta path finder that runs lins_ds' patch right after a watched module has executed. It stays installed:
    availability probes (``importlib.util.find_spec("deepspeed")``, as transformers does) get the real spec, and
    only an actual import runs the patch."""

    _busy = False

    def find_spec(self, name, path=None, target=None):
        if name not in WATCHED or self._busy:
            return None
        from importlib.util import find_spec

        self._busy = True
        try:
            spec = find_spec(name)
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            patch(name)

        spec.loader.exec_module = exec_then_patch
        return spec


def patch(name: str) -> None:
    """lins_ds' patch of the watched module ``name`` (imported already)."""
    global importing
    if "lins_ds" not in sys.modules:
        importing = True
        try:
            import lins_ds  # noqa: F401
        finally:
            importing = False
        _watch_program_import()
    sys.modules["lins_ds"].post_import(name)


def _watch_program_import() -> None:
    """This hook imported lins_ds before the program did: the program's own ``import lins_ds`` (or ``from lins_ds
    import ...``) later finds it cached and runs nothing, so it is noticed here, at the import statement, and makes
    Lins explicit. Undone once it is."""
    import builtins

    real = builtins.__import__

    def __import__(name, globals=None, locals=None, fromlist=(), level=0):
        global explicit
        if level == 0 and (name == "lins_ds" or name.startswith("lins_ds.")) and not explicit:
            caller = (globals or {}).get("__name__") or ""
            if caller != __name__ and caller != "lins_ds" and not caller.startswith("lins_ds."):
                explicit = True
                if builtins.__import__ is __import__:
                    builtins.__import__ = real
        return real(name, globals, locals, fromlist, level)

    if not explicit:
        builtins.__import__ = __import__


def _imported(name: str) -> bool:
    """``name`` has finished executing (a module still executing is in sys.modules already, half-built: when it
    imports the module that brought lins_ds in, say; its own import, which went through the finder, patches it)."""
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


def install() -> None:
    """Watch for the modules lins_ds patches; patch those imported already. Idempotent."""
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
    for name in WATCHED:
        if _imported(name):
            patch(name)


if "lins_ds" not in sys.modules:  # at start-up (the .pth); lins_ds installs it itself when imported first
    install()
