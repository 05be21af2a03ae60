"""DistRS's reward-service policies (sections 5 and 6): the request and job model, Algorithm 2's
estimate of outstanding requests, the queueing simulator and Algorithm 1's scaling decision,
trace replay with its baselines, and the reward service as a plan node.
"""
