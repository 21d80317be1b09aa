"""Live table deltas on a served model: apply, roll back, persist, replay; the sixfold-delta command."""
