"""Pure math: scores, solvers, attention references, kernels. Tensors in, tensors out."""
