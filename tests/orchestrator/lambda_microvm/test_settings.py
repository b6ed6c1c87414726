"""The start-up policy check: every refusal names the variable at fault."""

from __future__ import annotations

import pytest

from sandcell_orchestrator.errors import ConfigError
from sandcell_orchestrator.providers.lambda_settings import LambdaMicrovmSettings

IMAGE_ARN = "arn:aws:lambda:us-east-1:123456789012:microvm-image:sandcell"
EGRESS = "arn:aws:lambda:us-east-1:123456789012:network-connector:egress-1"
KEY = "r" * 40


def production(**extra: str) -> dict[str, str]:
    env = {
        "SANDCELL_ENV": "production",
        "SANDCELL_MICROVM_IMAGE": IMAGE_ARN,
        "SANDCELL_MICROVM_EGRESS_CONNECTORS": EGRESS,
        "SANDCELL_MICROVM_RUNNER_KEY": KEY,
    }
    env.update(extra)
    return env


def test_every_variable_is_read() -> None:
    """from_env reads each documented variable into the typed settings."""
    settings = LambdaMicrovmSettings.from_env(
        {
            "SANDCELL_MICROVM_IMAGE": IMAGE_ARN,
            "SANDCELL_MICROVM_IMAGE_VERSION": "3.1",
            "SANDCELL_MICROVM_ROLE_ARN": "arn:aws:iam::123456789012:role/sandcell-microvm",
            "SANDCELL_MICROVM_EGRESS_CONNECTORS": f"{EGRESS}, {EGRESS}-b",
            "SANDCELL_MICROVM_INGRESS_CONNECTORS": "arn:aws:lambda:us-east-1:aws:nc:ALL_INGRESS",
            "SANDCELL_MICROVM_ENDPOINT_URL": "http://127.0.0.1:8700",
            "SANDCELL_MICROVM_REGION": "eu-west-1",
            "SANDCELL_MICROVM_TOKEN_MINUTES": "15",
            "SANDCELL_MICROVM_BOOT_TIMEOUT_S": "45.5",
            "SANDCELL_MICROVM_MAX_DURATION_S": "3600",
            "SANDCELL_MICROVM_RETENTION_S": "0",
            "SANDCELL_MICROVM_TPS": "2.5",
            "SANDCELL_MICROVM_RUNNER_PORT": "9090",
            "SANDCELL_MICROVM_POLL_INTERVAL_S": "0.25",
            "SANDCELL_MICROVM_RUNNER_KEY": KEY,
            "SANDCELL_IDLE_TIMEOUT_S": "600",
            "SANDCELL_REGISTRY_URL": "redis://:pw@redis:6379/0",
        }
    )
    assert settings.image == IMAGE_ARN
    assert settings.image_version == "3.1"
    assert settings.execution_role_arn == "arn:aws:iam::123456789012:role/sandcell-microvm"
    assert settings.egress_connectors == (EGRESS, f"{EGRESS}-b")
    assert settings.ingress_connectors == ("arn:aws:lambda:us-east-1:aws:nc:ALL_INGRESS",)
    assert settings.endpoint_url == "http://127.0.0.1:8700"
    assert settings.region == "eu-west-1"
    assert settings.token_minutes == 15
    assert settings.token_lifetime_s == 900
    assert settings.boot_timeout_s == 45.5
    assert settings.max_duration_s == 3600
    assert settings.retention_s == 0
    assert settings.tps == 2.5
    assert settings.runner_port == 9090
    assert settings.poll_interval_s == 0.25
    assert settings.idle_timeout_s == 600
    assert settings.redis_url == "redis://:pw@redis:6379/0"
    assert settings.production is False


def test_defaults() -> None:
    """Only the image is required outside production."""
    settings = LambdaMicrovmSettings.from_env({"SANDCELL_MICROVM_IMAGE": "img"})
    assert settings.token_minutes == 60
    assert settings.idle_timeout_s == 1800
    assert settings.max_duration_s == 28_800
    assert settings.runner_port == 8080
    assert settings.endpoint_url is None
    assert settings.redis_url is None
    assert settings.runner_key is None


def test_a_file_registry_url_is_not_a_redis_url() -> None:
    settings = LambdaMicrovmSettings.from_env(
        {"SANDCELL_MICROVM_IMAGE": "img", "SANDCELL_REGISTRY_URL": "memory://"}
    )
    assert settings.redis_url is None


def test_production_passes_with_image_arn_egress_and_key() -> None:
    assert LambdaMicrovmSettings.from_env(production()).production


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"SANDCELL_MICROVM_IMAGE": ""}, "SANDCELL_MICROVM_IMAGE"),
        ({"SANDCELL_MICROVM_IMAGE": "bare-name"}, "SANDCELL_MICROVM_IMAGE"),
        ({"SANDCELL_MICROVM_EGRESS_CONNECTORS": ""}, "SANDCELL_MICROVM_EGRESS_CONNECTORS"),
        ({"SANDCELL_MICROVM_RUNNER_KEY": ""}, "SANDCELL_MICROVM_RUNNER_KEY"),
        ({"SANDCELL_MICROVM_ENDPOINT_URL": "http://x"}, "SANDCELL_MICROVM_ENDPOINT_URL"),
    ],
)
def test_production_refusals(env: dict[str, str], variable: str) -> None:
    """Under SANDCELL_ENV=production: image ARN, an egress connector and a runner key."""
    with pytest.raises(ConfigError, match=variable):
        LambdaMicrovmSettings.from_env(production(**env))


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SANDCELL_MICROVM_TOKEN_MINUTES", "61"),
        ("SANDCELL_MICROVM_TOKEN_MINUTES", "0"),
        ("SANDCELL_MICROVM_TOKEN_MINUTES", "ten"),
        ("SANDCELL_MICROVM_BOOT_TIMEOUT_S", "0"),
        ("SANDCELL_MICROVM_MAX_DURATION_S", "28801"),
        ("SANDCELL_MICROVM_RETENTION_S", "-1"),
        ("SANDCELL_MICROVM_TPS", "0"),
        ("SANDCELL_MICROVM_RUNNER_PORT", "70000"),
        ("SANDCELL_MICROVM_POLL_INTERVAL_S", "0"),
        ("SANDCELL_MICROVM_RUNNER_KEY", "short"),
        ("SANDCELL_MICROVM_ROLE_ARN", "sandcell-role"),
        ("SANDCELL_MICROVM_EGRESS_CONNECTORS", "not-an-arn"),
        ("SANDCELL_MICROVM_ENDPOINT_URL", "127.0.0.1:8700"),
        ("SANDCELL_IDLE_TIMEOUT_S", "30"),
    ],
)
def test_invalid_values_name_their_variable(variable: str, value: str) -> None:
    with pytest.raises(ConfigError, match=variable):
        LambdaMicrovmSettings.from_env({"SANDCELL_MICROVM_IMAGE": "img", variable: value})


def test_too_many_connectors() -> None:
    many = ",".join(f"{EGRESS}-{i}" for i in range(11))
    with pytest.raises(ConfigError, match="SANDCELL_MICROVM_EGRESS_CONNECTORS"):
        LambdaMicrovmSettings.from_env(
            {"SANDCELL_MICROVM_IMAGE": "img", "SANDCELL_MICROVM_EGRESS_CONNECTORS": many}
        )


def test_repr_hides_the_runner_key_and_redis_url() -> None:
    settings = LambdaMicrovmSettings.from_env(
        production(SANDCELL_REGISTRY_URL="redis://:hunter2-password@redis:6379/0")
    )
    text = repr(settings)
    assert KEY not in text
    assert "hunter2" not in text
    assert IMAGE_ARN in text
