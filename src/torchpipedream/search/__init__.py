"""How a plan is chosen: the planner (bisection and PipeDream's hierarchical DP, virtual-stage cuts) and schedule='auto'."""
