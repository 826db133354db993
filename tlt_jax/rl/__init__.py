"""RL: advantage estimators and policy losses, verifiable rewards."""
