"""Integrations of replaymoe with training libraries (each imports its library only when imported).

* :mod:`replaymoe.integrations.trl`: ``R3GRPOTrainer``, TRL's GRPO trainer with rollout routing replay.
"""
