"""Start-up: the plan made (fixed or solved) and agreed, the model's units assigned, parameters materialised or
replayed, the sequence length the plan is sized for (docs/design.md §7, §10)."""
