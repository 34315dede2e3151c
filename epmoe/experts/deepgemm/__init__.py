"""The `deepgemm` experts backend: DeepGEMM's grouped GEMMs (contiguous and masked) with fused Triton
passes between them (`backend`: the backend class; `kernels`: the Triton passes, imported when it runs)."""
