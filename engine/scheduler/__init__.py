"""Scheduling: the prefill adder (budget and chunking), the policies, and the step scheduler."""
