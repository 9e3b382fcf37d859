"""Stages: thin Hydra shells, each ``run(cfg, ctx) -> metrics`` plus ``main``."""
