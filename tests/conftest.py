"""One intra-op thread per test process.

The tests run tiny tensors, where a second thread only adds synchronisation; with pytest-xdist
(one worker per core) or another job on the machine, extra threads oversubscribe the cores and a
test takes 2-5x longer. Results do not depend on it: every comparison runs in one process.
"""

import torch

torch.set_num_threads(1)
