"""diffusers on neuron: a DDPM pipeline (UNet2D) and a DiT training step, against CPU."""

import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch.testing import assert_close


def _unet():
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    return UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                       block_out_channels=(16, 32), norm_num_groups=8,
                       down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"))


def test_ddpm_pipeline_on_neuron_matches_cpu():
    from diffusers import DDPMPipeline, DDPMScheduler

    pipe = DDPMPipeline(unet=_unet(), scheduler=DDPMScheduler(num_train_timesteps=50))
    kw = dict(batch_size=2, num_inference_steps=5, output_type="np")
    ref = pipe(generator=torch.Generator("cpu").manual_seed(0), **kw).images
    pipe.to("neuron")
    assert pipe.device.type == "neuron"
    # diffusers draws the noise for a neuron pipeline on CPU (randn_tensor), so the same CPU
    # generator gives the same noise on both devices.
    out = pipe(generator=torch.Generator("cpu").manual_seed(0), **kw).images
    assert out.shape == (2, 16, 16, 3) and np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)


def _dit():
    from diffusers import DiTTransformer2DModel

    from diffusers.models.embeddings import LabelEmbedding

    torch.manual_seed(0)
    model = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                  out_channels=4, num_layers=2, sample_size=8, patch_size=2,
                                  num_embeds_ada_norm=10, norm_num_groups=4)
    # Classifier-free-guidance label dropout draws from the *device's* generator, whose stream
    # differs from CPU's by design (as CUDA's does): off, so both devices see the same labels.
    for m in model.modules():
        if isinstance(m, LabelEmbedding):
            m.dropout_prob = 0.0
    return model


def _dit_steps(model, device, steps=2):
    from diffusers import DDPMScheduler

    sched = DDPMScheduler(num_train_timesteps=100)
    # SGD: Adam's g/sqrt(v) turns rounding noise into full-size steps wherever the exact
    # gradient is zero (the key projection's bias: softmax ignores a per-query constant), which
    # would compare the kernels' rounding, not training.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        x0 = torch.randn(2, 4, 8, 8, generator=g)
        noise = torch.randn(2, 4, 8, 8, generator=g)
        t = torch.randint(0, 100, (2,), generator=g)
        labels = torch.randint(0, 10, (2,), generator=g)
        noisy = sched.add_noise(x0, noise, t)
        opt.zero_grad()
        pred = model(noisy.to(device), timestep=t.to(device), class_labels=labels.to(device)).sample
        # DiT predicts noise and variance (learn_sigma): the first half of the channels is noise
        loss = F.mse_loss(pred[:, :4], noise.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_dit_training_steps_on_neuron_match_cpu():
    ref = _dit()
    dev = copy.deepcopy(ref).to("neuron")
    assert_close(torch.tensor(_dit_steps(dev, "neuron")), torch.tensor(_dit_steps(ref, "cpu")),
                 atol=1e-5, rtol=1e-4)
    for (n, p), (_, q) in zip(dev.named_parameters(), ref.named_parameters()):
        assert_close(p.detach().cpu(), q.detach(), atol=1e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")
