"""Environments: the domains RL trains on."""
