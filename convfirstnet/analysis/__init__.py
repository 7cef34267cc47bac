"""Static analysis of the fused kernels: what they compile to and what that costs, without a GPU.

``compiled`` compiles recorded launches for a GPU target with Triton's own pipeline (ptxas included)
and reads the results: registers, stack (spills), shared memory, occupancy, tensor-core instruction
kind, and the SASS listing with its loops. Figures derived from it are estimates, not measurements.
"""
