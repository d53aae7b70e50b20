"""Environment of the tests whose ranks are threads of one process (rank_threads.h).

PyTorch's flight recorder is off: in torch 2.11 its record() inserts a new group's status into a
shared map before taking its lock, so several groups issuing their first collectives at once can
corrupt the map (seen as a SIGSEGV in fsdp_test). A worker process has one group, which cannot race
with itself.
"""

RANK_THREADS_ENV = {"TORCH_FR_BUFFER_SIZE": "0"}
