"""Saying what the plan decided: a table per device, and a drawing of the graph and devices."""
