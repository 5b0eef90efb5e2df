"""AWS profile files (storage/aws_config.py): what the S3 client gets from ~/.aws/credentials and
~/.aws/config when the environment does not set it, with the AWS precedence rules. Real files in a
temporary directory; the end-to-end run against moto with authentication on is in
test_remote_models.py."""

from __future__ import annotations

import pytest

from sluice.storage.aws_config import AwsConfigError, profile_settings

SECRET = "profile-secret-0123456789"


@pytest.fixture
def files(tmp_path):
    creds, config = tmp_path / "credentials", tmp_path / "config"
    creds.write_text(f"[default]\naws_access_key_id = AKIADEFAULT\naws_secret_access_key = {SECRET}\n\n"
                     f"[work]\naws_access_key_id = AKIAWORK\naws_secret_access_key = work-{SECRET}\n"
                     "aws_session_token = tok-work\n")
    config.write_text("[default]\nregion = eu-west-1\n\n"
                      "[profile work]\nregion = us-west-2\nendpoint_url = http://127.0.0.1:9\n"
                      "s3 =\n    addressing_style = path\n\n"
                      f"[profile cfgkeys]\naws_access_key_id = AKIACFG\naws_secret_access_key = cfg-{SECRET}\n\n"
                      "[profile sso]\nsso_session = corp\nregion = us-east-2\n")
    return {"HOME": str(tmp_path / "home"), "AWS_SHARED_CREDENTIALS_FILE": str(creds), "AWS_CONFIG_FILE": str(config)}


def test_default_profile_keys_and_region(files):
    assert profile_settings(files) == {"access_key_id": "AKIADEFAULT", "secret_access_key": SECRET,
                                       "region": "eu-west-1"}


def test_named_profile_uses_its_config_section_and_endpoint(files):
    got = profile_settings({**files, "AWS_PROFILE": "work"})
    assert got == {"access_key_id": "AKIAWORK", "secret_access_key": f"work-{SECRET}", "session_token": "tok-work",
                   "region": "us-west-2", "endpoint": "http://127.0.0.1:9"}
    # AWS_DEFAULT_PROFILE is the older name of the same setting
    assert profile_settings({**files, "AWS_DEFAULT_PROFILE": "work"})["access_key_id"] == "AKIAWORK"
    # keys may also be in the config file's profile section
    assert profile_settings({**files, "AWS_PROFILE": "cfgkeys"})["access_key_id"] == "AKIACFG"


def test_the_environment_wins(files):
    env = {**files, "AWS_PROFILE": "work", "AWS_ACCESS_KEY_ID": "AKIAENV", "AWS_SECRET_ACCESS_KEY": "env",
           "AWS_REGION": "ap-south-1", "AWS_ENDPOINT_URL": "http://127.0.0.1:1"}
    assert profile_settings(env) == {}  # the client reads all of these from the environment itself
    assert profile_settings({**files, "AWS_PROFILE": "work", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "true"}).get(
        "endpoint") is None


def test_no_files_and_no_named_profile_is_nothing(tmp_path):
    assert profile_settings({"HOME": str(tmp_path)}) == {}  # ~/.aws/* absent: the client's own chain


def test_unusable_profiles_are_clear_errors(files, tmp_path):
    with pytest.raises(AwsConfigError, match="AWS profile 'nope' \\(from AWS_PROFILE\\) is in neither"):
        profile_settings({**files, "AWS_PROFILE": "nope"})
    with pytest.raises(AwsConfigError, match="sso_session, which Sluice does not resolve"):
        profile_settings({**files, "AWS_PROFILE": "sso"})
    half = tmp_path / "half"
    half.write_text(f"[default]\naws_secret_access_key = {SECRET}\n")
    with pytest.raises(AwsConfigError, match="has aws_secret_access_key but no aws_access_key_id") as err:
        profile_settings({**files, "AWS_SHARED_CREDENTIALS_FILE": str(half)})
    assert SECRET not in str(err.value)


def test_a_broken_file_is_named_without_its_contents(files, tmp_path):
    bad = tmp_path / "bad"
    bad.write_text(f"aws_secret_access_key = {SECRET}\n[default]\n")  # a key before any section
    with pytest.raises(AwsConfigError) as err:
        profile_settings({**files, "AWS_SHARED_CREDENTIALS_FILE": str(bad)})
    assert str(bad) in str(err.value) and "line 1" in str(err.value) and SECRET not in str(err.value)


def test_no_credentials_with_the_metadata_service_off(files, tmp_path):
    from sluice.storage.aws_config import missing_credentials

    bare = {"HOME": str(tmp_path), "AWS_EC2_METADATA_DISABLED": "true"}
    assert "no AWS credentials" in missing_credentials({}, bare)
    assert missing_credentials({}, {**bare, "AWS_EC2_METADATA_DISABLED": "false"}) is None  # the client asks IMDS
    assert missing_credentials(profile_settings({**files, **bare}), {**files, **bare}) is None  # the profile's keys
    for var in ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_SKIP_SIGNATURE"):
        assert missing_credentials({}, {**bare, var: "true"}) is None
    assert missing_credentials({}, {**bare, "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b"}) is None
