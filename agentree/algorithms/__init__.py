"""Pure algorithms: advantage estimators, the clipped loss, micro-batches (padded or
tree-packed), the output layer and the attention kernel. No state, no I/O: each takes tensors
or trees and returns numbers."""
