"""Pure algorithms: advantage estimators, the clipped loss, micro-batching, tree packing and the
output layer. No state, no I/O: each takes tensors or trees and returns numbers."""
