"""The units the plan counts in: GiB, and an element's bytes by model.dtype."""

GiB = 2**30
ELT = {"float32": 4, "float64": 8, "bfloat16": 2}
