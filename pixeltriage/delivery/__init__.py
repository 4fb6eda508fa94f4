"""Delivery: which scored memories reach the answering model as pixels, and what that costs it.

policy (top_k, RateGate, token_budget), cost (visual tokens per answering model), host (prompt messages with the
chosen images), report (a scored question as a decision report). Nothing here runs the forward.
"""
