"""Configurations as data (no torch): the simulator, the planner and the executor share them."""
