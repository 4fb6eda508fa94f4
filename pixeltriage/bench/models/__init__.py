"""The benchmarks' analytic models: pure functions of configs and shapes that run no forward and time nothing.

flops (the FLOP model of System One and the answering models), roofline (System One's GPU time at a device's
published peaks), prefill_cost (a question's prefill compute and visual tokens under each delivery).
"""
