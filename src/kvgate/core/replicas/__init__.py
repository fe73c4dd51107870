"""Replicas that admit as one: what one replica tells the others and how it uses theirs."""
