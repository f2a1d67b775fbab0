"""`tokenmind serve` over a diffusion run: POST /v1/images/generations through the official openai
client, its 4xx answers to bad input, /v1/models and the image page, with a tiny random DiT saved
as a `tokenmind diffusion train` run folder (Fashion-MNIST's classes and 28×28 size, no data)."""

import base64
import io
import threading

import httpx
import openai
import pytest
import torch
from PIL import Image
from test_serve_fixtures import LiveServer

from tokenmind.diffusion.config import load_config
from tokenmind.diffusion.train import build_model, diffusion_model_dir, save_diffusion_model

torch.set_num_threads(1)
TINY_DIT = ['model.options={patch_size: 7, hidden_size: 32, num_layers: 1, num_heads: 2}']


def save_tiny_dit(path):
    """A random 1-block DiT as a diffusion run folder `path` (its final/ export)."""
    cfg = load_config(overrides=TINY_DIT)
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():  # adaLN-Zero starts at zero output, which no label can change: perturb every weight
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_diffusion_model(model.state_dict(), cfg, path / "final")
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return save_tiny_dit(tmp_path_factory.mktemp("serve") / "dit-fashion")


@pytest.fixture(scope="module")
def server(run_dir):
    with LiveServer(None, model=str(run_dir), max_images=4, max_queue=1) as server:
        yield server


def png_size(b64: str) -> tuple[int, int]:
    picture = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert picture.format == "PNG" and picture.mode == "L"
    return picture.size


def test_a_diffusion_run_is_detected_and_an_llm_folder_is_not(run_dir, tmp_path):
    assert diffusion_model_dir(run_dir) == run_dir / "final"
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert diffusion_model_dir(tmp_path) is None


def test_openai_client_generates_pngs_of_the_asked_class(server):
    client = server.openai()
    assert [m.id for m in client.models.list().data] == ["dit-fashion"]
    result = client.images.generate(model="dit-fashion", prompt="Sneaker", n=2, response_format="b64_json",
                                    size="28x28", extra_body={"steps": 3, "seed": 7})
    assert len(result.data) == 2 and result.data[0].revised_prompt == "sneaker"
    assert [png_size(d.b64_json) for d in result.data] == [(28, 28), (28, 28)]
    assert result.data[0].b64_json != result.data[1].b64_json  # two samples, not one copied
    again = client.images.generate(model="dit-fashion", prompt="sneaker", n=2, extra_body={"steps": 3, "seed": 7})
    assert [d.b64_json for d in again.data] == [d.b64_json for d in result.data]  # a seed fixes the images
    other = client.images.generate(prompt="ankle boot", n=1, extra_body={"steps": 3, "seed": 7})
    assert other.data[0].revised_prompt == "ankle-boot"
    assert other.data[0].b64_json != result.data[0].b64_json  # the class changes the sample
    url = client.images.generate(prompt="bag", response_format="url", extra_body={"steps": 2}).data[0].url
    assert url.startswith("data:image/png;base64,") and png_size(url.split(",", 1)[1]) == (28, 28)


@pytest.mark.parametrize("body, status, param, says", [
    ({"prompt": "unicorn"}, 400, "prompt", "sneaker"),  # the valid classes are listed
    ({"prompt": "bag", "n": 5}, 400, "n", "at most 4"),
    ({"prompt": "bag", "n": 0}, 400, "n", "greater than or equal to 1"),
    ({"prompt": "bag", "n": "2"}, 400, "n", "valid integer"),
    ({"prompt": "bag", "size": "1024x1024"}, 400, "size", "28x28"),
    ({"prompt": "bag", "steps": 0}, 400, "steps", "greater than or equal to 1"),
    ({"prompt": "bag", "response_format": "png"}, 400, "response_format", "b64_json"),
    ({"prompt": "bag", "model": "dall-e-3"}, 404, "model", "dit-fashion"),
    ({"n": 1}, 400, "prompt", "Field required"),
    ({"prompt": ""}, 400, "prompt", "at least 1 character"),
])
def test_bad_requests_get_4xx_naming_the_field(server, body, status, param, says):
    response = httpx.post(server.url + "/v1/images/generations", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_openai_client_sees_bad_input_as_bad_request_and_the_server_goes_on(server):
    client = server.openai()
    with pytest.raises(openai.BadRequestError, match="choose one of t-shirt, trouser"):
        client.images.generate(prompt="spaceship")
    response = httpx.post(server.url + "/v1/images/generations", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert len(client.images.generate(prompt="dress", extra_body={"steps": 1}).data) == 1


def test_sampling_does_not_block_the_event_loop_and_full_queue_gets_429(server):
    """While one slow request samples on the worker thread, /health answers; with max_queue=1 a
    third request at once is refused with 429."""
    results, slow = [], {"prompt": "coat", "n": 4, "steps": 400}

    def post():
        results.append(httpx.post(server.url + "/v1/images/generations", json=slow, timeout=120).status_code)

    threads = [threading.Thread(target=post) for _ in range(2)]
    for t in threads:
        t.start()
    while server.service.admission.in_flight < 2:
        assert all(t.is_alive() for t in threads)
    health = httpx.get(server.url + "/health", timeout=5)
    assert health.status_code == 200 and health.json()["images"]["in_flight"] == 2
    refused = httpx.post(server.url + "/v1/images/generations", json={"prompt": "coat"})
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    for t in threads:
        t.join()
    assert results == [200, 200]
    metrics = server.metrics()
    assert metrics['tokenmind_requests_total{endpoint="/v1/images/generations",status="429"}'] >= 1
    assert metrics["tokenmind_requests_in_flight"] == 0
