"""Byte units, defined once: every figure zero_bench prints or stores in MiB / GiB uses these."""
MiB = 2**20
GiB = 2**30
# Bytes per element of each precision.
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
