"""S3 settings from the standard AWS configuration files, for what the environment does not give.

The S3 client (obstore) reads the ``AWS_*`` environment variables, web identity, ECS and the
instance metadata service, but not the shared files the AWS CLI and SDKs write. This module
reads them (``configparser``; no boto dependency), with the AWS precedence rules:

- the profile is ``AWS_PROFILE`` (else ``AWS_DEFAULT_PROFILE``, else ``default``);
- the files are ``AWS_SHARED_CREDENTIALS_FILE`` (default ``~/.aws/credentials``, sections
  ``[name]``) and ``AWS_CONFIG_FILE`` (default ``~/.aws/config``, sections ``[profile name]``
  and ``[default]``); for keys, the credentials file wins over the config file;
- keys (``aws_access_key_id``, ``aws_secret_access_key``, ``aws_session_token``) come from the
  profile only when the environment has no ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``;
  ``region`` only without ``AWS_REGION``/``AWS_DEFAULT_REGION``; ``endpoint_url`` only without
  ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` (and not with
  ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true``).

With the instance metadata service switched off (``AWS_EC2_METADATA_DISABLED=true``) and no
credentials anywhere, ``missing_credentials`` says so before any request (the client would
otherwise still ask the metadata address).

A profile named explicitly that is in neither file, a profile with half a key pair, or one that
gets its credentials some other way (``role_arn``, ``credential_process``, SSO: not read here)
is an ``AwsConfigError`` naming the profile and the files, never a silent fall-through to other
credentials. Secrets are never put in a message: a file that does not parse is named with its
line number only (configparser's own message quotes the line).
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Mapping
from pathlib import Path

KEY_FIELDS = {"aws_access_key_id": "access_key_id", "aws_secret_access_key": "secret_access_key",
              "aws_session_token": "session_token"}
# ways a profile can name credentials that are not static keys; Sluice does not resolve these
_INDIRECT = ("role_arn", "credential_process", "sso_session", "sso_start_url", "web_identity_token_file",
             "credential_source")


class AwsConfigError(OSError):
    """An AWS profile that cannot be used as written (the message names the profile and files)."""


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")


def _read(path: Path) -> configparser.RawConfigParser | None:
    """The file parsed, or None when it does not exist."""
    parser = configparser.RawConfigParser(interpolation=None, strict=False, default_section="\0none")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise AwsConfigError(f"AWS configuration file {path}: cannot read it ({getattr(e, 'strerror', None) or e})") \
            from None
    try:
        parser.read_string(text, source=str(path))
    except configparser.Error as e:  # its message quotes the offending line, which may hold a secret
        line = getattr(e, "lineno", None)
        if line is None and getattr(e, "errors", None):
            line = e.errors[0][0]
        where = f" at line {line}" if line else ""
        raise AwsConfigError(f"AWS configuration file {path}: not an INI file{where}") from None
    return parser


def _section(parser: configparser.RawConfigParser | None, names: tuple[str, ...]) -> dict[str, str] | None:
    if parser is None:
        return None
    for name in names:
        if parser.has_section(name):
            return {k.strip().lower(): v.strip() for k, v in parser.items(name) if v is not None}
    return None


def profile_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """obstore ``S3Store`` config entries (``access_key_id``, ``secret_access_key``, ``session_token``,
    ``region``, ``endpoint``) from the AWS profile files, for what ``environ`` (default
    ``os.environ``) does not set itself. Empty when neither file has the profile and the profile was
    not named explicitly. Raises ``AwsConfigError``."""
    env = os.environ if environ is None else environ
    named = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE")
    profile = named or "default"
    home = Path(env.get("HOME") or Path.home())

    def where(var: str, default: str) -> Path:
        value = env.get(var)
        return Path(os.path.expanduser(value)) if value else home / default

    cred_path = where("AWS_SHARED_CREDENTIALS_FILE", ".aws/credentials")
    config_path = where("AWS_CONFIG_FILE", ".aws/config")
    creds = _section(_read(cred_path), (profile,))
    conf = _section(_read(config_path), ("default",) if profile == "default" else (f"profile {profile}", profile))
    if creds is None and conf is None:
        if named:
            var = "AWS_PROFILE" if env.get("AWS_PROFILE") else "AWS_DEFAULT_PROFILE"
            raise AwsConfigError(f"AWS profile {profile!r} (from {var}) is in neither {cred_path} nor {config_path}")
        return {}
    out: dict[str, str] = {}
    env_keys = bool(env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"))
    if not env_keys:
        for source, path in ((creds, cred_path), (conf, config_path)):
            if not source:
                continue
            keys = {KEY_FIELDS[k]: v for k, v in source.items() if k in KEY_FIELDS and v}
            if not keys:
                continue
            if "access_key_id" not in keys or "secret_access_key" not in keys:
                have, lack = ("aws_access_key_id", "aws_secret_access_key") if "access_key_id" in keys else \
                    ("aws_secret_access_key", "aws_access_key_id")
                raise AwsConfigError(f"AWS profile {profile!r} in {path} has {have} but no {lack}")
            out.update(keys)
            break
        else:
            indirect = sorted({k for s in (creds, conf) if s for k in s if k in _INDIRECT})
            if indirect and named:
                raise AwsConfigError(
                    f"AWS profile {profile!r} gets its credentials by {', '.join(indirect)}, which Sluice does not "
                    f"resolve; give static keys in {cred_path} or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
    conf = conf or {}
    if not (env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")) and conf.get("region"):
        out["region"] = conf["region"]
    if not (env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")) \
            and not _truthy(env.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS")) and conf.get("endpoint_url"):
        out["endpoint"] = conf["endpoint_url"]
    return out


def missing_credentials(settings: Mapping[str, str], environ: Mapping[str, str] | None = None) -> str | None:
    """Why S3 requests could not be signed, or None. Only when the instance metadata service is
    switched off (``AWS_EC2_METADATA_DISABLED=true``, as the AWS SDKs honour it; obstore would ask it
    anyway): no keys in the environment or ``settings`` (the profile), no web identity or container
    credentials, and no ``AWS_SKIP_SIGNATURE``."""
    env = os.environ if environ is None else environ
    if not _truthy(env.get("AWS_EC2_METADATA_DISABLED")) or _truthy(env.get("AWS_SKIP_SIGNATURE")):
        return None
    if settings.get("access_key_id") or (env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY")):
        return None
    if any(env.get(v) for v in ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                                "AWS_CONTAINER_CREDENTIALS_FULL_URI")):
        return None
    profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    return (f"no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or keys for profile {profile!r} "
            "in the AWS credentials file (the instance metadata service is off: AWS_EC2_METADATA_DISABLED=true; "
            "AWS_SKIP_SIGNATURE=true reads a public bucket unsigned)")
