"""The C++ CPU kernels: their build and cache (`build.py`), the headers they share, and the
layer-product kernels (`f32_matmul.cc`, `bf16_matmul.cc`, `quantized_matmul.cc`, called from
jllm/models and jllm/quantization). The attention kernel's C++ flavour stays in its kit,
`ragged_paged_attention/cpu_kernel.cc`, and is built here too."""
