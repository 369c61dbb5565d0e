"""GPU kernels of the device ops register here, through the same registry as the CPU ones.

None exists yet: on GPU every op runs its pure-JAX reference
(`embedmesh.device.ops.reference`). A GPU kernel is a function with its op's
reference signature, registered with
`embedmesh.device.ops.register_kernel(op, "gpu", kernel, ready=..., supports=...)`
(as `embedmesh.device.ops` registers `embedmesh.device.ops.cpu.KERNELS` for
"cpu"); "gpu" covers CUDA and ROCm.
"""
