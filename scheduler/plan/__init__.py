"""The M2Flow planner (RLinf section 3.4, Algorithm 1): profiles, fitted cost models, the DP
tables over the workflow graph, the plan tree it returns and a plan's predicted timeline.
"""
