"""How much to draft: the adaptive speculation policy, its probe schedule, the step-cost
model and the acceptance statistics."""
