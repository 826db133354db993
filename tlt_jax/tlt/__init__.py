"""Taming the Long Tail: drafter training from the rollout's own hidden states."""
