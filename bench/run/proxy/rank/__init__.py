"""Proxy ranks: run one rank of a large layout for real on a single machine, inside a fake world.

``world`` joins the fake world, ``build`` builds only the rank's share of the model, ``peers``
stands in for the other ranks of its expert-parallel group and ``pipeline`` for its neighbouring
pipeline stages. Collectives are issued (so ``bench.run.collective_log`` records their sizes) but
do nothing.
"""
