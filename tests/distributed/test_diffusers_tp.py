"""diffusers' tensor parallelism on a neuron mesh: ``apply_tensor_parallel`` dispatches to its
Neuron backend (``hooks/tensor_parallel_neuron.py``: weights pre-sharded on CPU with
``DTensor.from_local`` onto ``torch.neuron.current_device()``, then the TP hooks). A tiny Flux
transformer split over 2 ranks must give the full model's CPU output."""

import torch
from torch.testing import assert_close


def _flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2,
                                  joint_attention_dim=32, pooled_projection_dim=16,
                                  axes_dims_rope=[4, 4, 8])


def _inputs():
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(1, 16, 8, generator=g),
                encoder_hidden_states=torch.randn(1, 6, 32, generator=g),
                pooled_projections=torch.randn(1, 16, generator=g),
                timestep=torch.tensor([0.5]),
                img_ids=torch.randint(0, 4, (16, 3), generator=g).float(),
                txt_ids=torch.zeros(6, 3))


def case_flux_tensor_parallel_on_neuron_mesh_matches_cpu(rank, size):
    from diffusers.hooks import tensor_parallel as tp
    from diffusers.models._modeling_parallel import TensorParallelConfig
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    model = _flux().eval()
    with torch.no_grad():
        expected = model(**_inputs()).sample
    mesh = init_device_mesh("neuron", (size,))
    cfg = TensorParallelConfig(mesh=mesh)
    cfg.setup(rank, size, torch.device("neuron", torch.neuron.current_device()), mesh)
    used = []
    import diffusers.hooks.tensor_parallel_neuron as tpn

    orig = tpn._apply_tp_neuron

    def spy(*a, **k):
        used.append(True)
        return orig(*a, **k)

    tpn._apply_tp_neuron = spy
    try:
        tp.apply_tensor_parallel(model, cfg, model._tp_plan)  # weights still on CPU, as required
    finally:
        tpn._apply_tp_neuron = orig
    assert used, "the Neuron TP backend was not used"
    q = model.transformer_blocks[0].attn.to_q.weight
    assert isinstance(q, DTensor) and q.device.type == "neuron"
    assert q.to_local().shape[0] == q.shape[0] // size
    model.to("neuron")  # the replicated rest (norms, embeddings)
    with torch.no_grad():
        out = model(**{k: v.to("neuron") for k, v in _inputs().items()}).sample
    out = out.full_tensor() if isinstance(out, DTensor) else out
    assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-4)


def test_flux_tensor_parallel_on_neuron_mesh_matches_cpu(world2):
    world2.run(case_flux_tensor_parallel_on_neuron_mesh_matches_cpu, timeout_s=180)
