"""The pool's room: one pool of expert slots that every MoE layer of the model reads.

arrays (its memory), slots (which expert each slot holds, fences, the policy), fill (experts
into slots), calls (a call's rows as slot numbers, groups), chunks (a layer's prefill steps'
calls together), bank (the pool's life and a layer call whole), speculate (decode steps on the
device's map), memory (its size), machine (what the machine has left: a cgroup's limit,
vm_stat, a GPU's free memory), cuda_memory (the CUDA copier), prefetch (the next layer's
guess), dispatch (the kernel MLX picks). Nothing here imports the model wrapper, the sources or
the front doors (docs/architecture.md).
"""
