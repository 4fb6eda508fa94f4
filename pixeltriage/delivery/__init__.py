"""Delivery: which scored memories reach the answering model as pixels, and what that costs it.

policy (top_k, RateGate, token_budget), decision (`decide` -> `Decision`, and the rerank ordering), profiles (the
registry of answering models, each with its visual-token rule and its source; docs/delivery.md), rules (the rule
families), cost (visual tokens of a delivery), host (prompt messages with the chosen images), report (a scored
question as a decision report). Nothing here runs the forward.
"""
