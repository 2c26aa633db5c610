"""CPU acceleration: native kernels, the fused and quantised drafts, the packed target."""
