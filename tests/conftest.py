import torch

# Ranks run one intra-op thread each on these 2-core machines; the reference runs in this
# process, where a second OpenMP thread only spins against the rank processes.
torch.set_num_threads(1)
