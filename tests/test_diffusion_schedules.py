"""The diffusion schedules and scheduler steps against diffusers 0.42.1 on the same inputs: the same
timesteps, the same model outputs, the same generator noise."""

import pytest
import torch

from tokenmind.diffusion.schedules import (
    DDIMScheduler,
    DDPMScheduler,
    FlowMatchEulerScheduler,
    NoiseSchedule,
    flow_interpolate,
    flow_velocity,
    spaced_timesteps,
)

diffusers = pytest.importorskip("diffusers")

SHAPE = (2, 1, 8, 8)


def model_outputs(n: int) -> list[torch.Tensor]:
    """Stand-ins for a model's outputs, one per step, the same for both implementations."""
    g = torch.Generator().manual_seed(1)
    return [torch.randn(SHAPE, generator=g) for _ in range(n)]


@pytest.mark.parametrize("kind", ["linear", "scaled_linear", "squaredcos_cap_v2"])
def test_betas_and_alphas_cumprod_match_diffusers(kind):
    ours = NoiseSchedule(kind, 1000, 1e-4, 0.02)
    ref = diffusers.DDPMScheduler(num_train_timesteps=1000, beta_schedule=kind, beta_start=1e-4, beta_end=0.02)
    torch.testing.assert_close(ours.betas, ref.betas)
    torch.testing.assert_close(ours.alphas_cumprod, ref.alphas_cumprod)


@pytest.mark.parametrize("spacing", ["leading", "trailing", "linspace"])
@pytest.mark.parametrize("steps", [1, 7, 50, 1000])
def test_spaced_timesteps_match_diffusers(spacing, steps):
    ref = diffusers.DDIMScheduler(timestep_spacing=spacing)
    ref.set_timesteps(steps)
    assert spaced_timesteps(1000, steps, spacing).tolist() == ref.timesteps.tolist()


def test_add_noise_and_v_target_match_diffusers():
    ours, ref = NoiseSchedule("squaredcos_cap_v2"), diffusers.DDPMScheduler(beta_schedule="squaredcos_cap_v2")
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)
    t = torch.tensor([3, 917])
    torch.testing.assert_close(ours.add_noise(x0, noise, t), ref.add_noise(x0, noise, t))
    torch.testing.assert_close(ours.target("v_prediction", x0, noise, t), ref.get_velocity(x0, noise, t))


@pytest.mark.parametrize("prediction_type", ["epsilon", "sample", "v_prediction"])
def test_split_inverts_every_target(prediction_type):
    schedule = NoiseSchedule("linear")
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)
    t = torch.tensor([10, 600])
    x_t = schedule.add_noise(x0, noise, t)
    x0_hat, eps_hat = schedule.split(prediction_type, schedule.target(prediction_type, x0, noise, t), x_t, t)
    torch.testing.assert_close(x0_hat, x0, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(eps_hat, noise, atol=1e-4, rtol=1e-4)


def run_both(ours, ref, steps: int, ref_prev=None, **ref_kwargs):
    """Step both schedulers over their timesteps with the same outputs and seeds; every
    intermediate sample must agree."""
    ref.set_timesteps(steps)
    points = ours.timesteps(steps)
    assert points[:-1].tolist() == ref.timesteps.tolist()
    g_ours, g_ref = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    x_ours = x_ref = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    for t, t_next, out in zip(points[:-1], points[1:], model_outputs(steps)):
        if ref_prev is not None:  # diffusers' own idea of the previous step (DDIM: t − T // n)
            t_next = ref_prev(int(t))
        x_ours = ours.step(out, t, t_next, x_ours, generator=g_ours)
        x_ref = ref.step(out, t, x_ref, generator=g_ref, **ref_kwargs).prev_sample
        torch.testing.assert_close(x_ours, x_ref, atol=1e-5, rtol=1e-5)
    return x_ours


@pytest.mark.parametrize("kind", ["linear", "scaled_linear", "squaredcos_cap_v2"])
@pytest.mark.parametrize("prediction_type", ["epsilon", "sample", "v_prediction"])
@pytest.mark.parametrize("spacing,clip", [("leading", True), ("trailing", False)])
def test_ddpm_step_matches_diffusers(kind, prediction_type, spacing, clip):
    config = dict(beta_schedule=kind, prediction_type=prediction_type, clip_sample=clip, timestep_spacing=spacing)
    ours = DDPMScheduler(NoiseSchedule(kind), prediction_type, clip_sample=clip, timestep_spacing=spacing)
    run_both(ours, diffusers.DDPMScheduler(**config), steps=20)


@pytest.mark.parametrize("kind", ["linear", "squaredcos_cap_v2"])
@pytest.mark.parametrize("prediction_type", ["epsilon", "sample", "v_prediction"])
@pytest.mark.parametrize("spacing,steps,eta", [("leading", 7, 0.0), ("trailing", 10, 0.0), ("leading", 10, 0.7)])
def test_ddim_step_matches_diffusers(kind, prediction_type, spacing, steps, eta):
    config = dict(beta_schedule=kind, prediction_type=prediction_type, timestep_spacing=spacing, clip_sample=True)
    ours = DDIMScheduler(NoiseSchedule(kind), prediction_type, clip_sample=True, timestep_spacing=spacing, eta=eta)
    run_both(ours, diffusers.DDIMScheduler(**config), steps, ref_prev=lambda t: t - 1000 // steps, eta=eta)


def test_ddim_trailing_with_an_uneven_step_count_matches_diffusers_given_its_previous_step():
    """Where T/n is not an integer, diffusers' DDIM jumps t → t − ⌊T/n⌋ (off the grid); our step
    takes the target explicitly and agrees when given the same one."""
    ours = DDIMScheduler(NoiseSchedule("linear"), "epsilon", timestep_spacing="trailing")
    run_both(ours, diffusers.DDIMScheduler(timestep_spacing="trailing"), 7, ref_prev=lambda t: t - 1000 // 7)


@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("steps", [1, 4, 28])
def test_flow_match_euler_matches_diffusers(shift, steps):
    ours = FlowMatchEulerScheduler(1000, shift)
    ref = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    ref.set_timesteps(steps)
    torch.testing.assert_close(ours.timesteps(steps), ref.sigmas)
    assert [ours.model_time(s) for s in ours.timesteps(steps)[:-1]] == pytest.approx(ref.timesteps.tolist(), rel=1e-6)
    g = torch.Generator().manual_seed(3)
    x_ours = x_ref = torch.randn(SHAPE, generator=g)
    points = ours.timesteps(steps)
    for sigma, sigma_next, t, out in zip(points[:-1], points[1:], ref.timesteps, model_outputs(steps)):
        x_ours = ours.step(out, sigma, sigma_next, x_ours)
        x_ref = ref.step(out, t, x_ref).prev_sample
        torch.testing.assert_close(x_ours, x_ref)


def test_flow_euler_with_the_true_velocity_lands_on_x0_in_one_step():
    """On the straight path the velocity is constant, so one Euler step from σ = 1 is exact."""
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)
    scheduler = FlowMatchEulerScheduler()
    sigma = scheduler.timesteps(1)[0]
    x = flow_interpolate(x0, noise, sigma.expand(SHAPE[0]))
    torch.testing.assert_close(scheduler.step(flow_velocity(x0, noise), sigma, 0.0, x), x0)


def test_bad_settings_name_the_choices():
    with pytest.raises(ValueError, match="beta_schedule='cosine' is not one of linear"):
        NoiseSchedule("cosine")
    with pytest.raises(ValueError, match="prediction_type='eps' is not one of epsilon"):
        DDPMScheduler(NoiseSchedule(), "eps")
    with pytest.raises(ValueError, match="steps=2000 must be between 1 and the 1000"):
        spaced_timesteps(1000, 2000)
