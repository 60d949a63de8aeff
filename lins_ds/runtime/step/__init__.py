"""The step machinery: units and their states, the hooks that drive them, the optimizer adapter and the host side of
offload (docs/design.md §4, §13). Imports nothing of the other rooms."""
