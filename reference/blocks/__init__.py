"""The qwen4exp blocks as small NumPy functions (one module per block family).

Every function computes in the dtype of its inputs (float32 by default, float64 on request); none
of them holds state: the carried state (conv histories, recurrent state, KV, n-gram context) is
passed in and returned, and owned by :mod:`reference.session`.
"""
