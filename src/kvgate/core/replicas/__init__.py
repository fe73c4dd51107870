"""Replicas that admit as one: what one replica tells the others, and how it uses theirs.

`view` is the `PeerView` a replica publishes and its JSON form; `exchange` builds this
replica's view and takes the others' (the flow controller's side of the exchange); `peers`
folds their views in and splits a node's slack between replicas; `claims` holds this
replica's claims on each node's slack and the allowance they leave until the next sync.
The shell moves the views between replicas (`kvgate.cluster`).
"""
