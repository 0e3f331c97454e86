"""The machine a run measures on: how many bytes a rank may use, the GPUs (NVML, CUDA, the
emulated card), the CPU's native kinds, peak FLOP/s, the CUDA toolkit, fixed terms measured once.

capacity.py      one answer to "how many bytes may a rank use", and which peak is compared with it
gpu.py           one rank's GPU: which device, the emulated capacity, its memory as CUDA and NVML see it
nvml.py          NVML, the one seam to the GPUs: devices of this node mapped to CUDA indices
cpu_features.py  what this CPU computes natively (bf16 or not), torch's capability, oneDNN's limit
environment.py   the machine a trial runs on: CPU, memory, GPUs, library versions
metrics.py       FLOPs -> MFU / HFU, and the peak FLOP/s they are measured against
toolkit.py       the CUDA toolkit DeepSpeed JIT-builds its ops with
aio.py           what NVMe offload needs here: DeepSpeed's async_io op (libaio), an O_DIRECT swap folder
calibration.py   this machine's fixed terms as `zero_bench calibrate` measured them, and their cache
rate_probes.py   this CPU's memory bandwidth and CPU Adam rate, measured in-process (calibrate stores them)
rates.py         the rates a time prediction reads (matmul, memory, links, PCIe, CPU Adam, NVMe), each sourced
"""
