"""Where an ``s3://`` tier's objects live: the URI parsed and checked, and the endpoint resolved.

- :class:`S3Location` and :func:`parse_s3_uri`: ``s3://bucket[/prefix][?endpoint_url=…&region=…]``
  — a bucket name S3 accepts, safe prefix segments, no credentials anywhere in the URI;
- :func:`check_endpoint`: an endpoint is ``http(s)://host[:port]`` without credentials;
- :func:`store_endpoint`: the endpoint the store talks to (the URI's, else the environment's)
  and whether it may use plain HTTP.

No message of this module repeats a URI's credentials or an endpoint's text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

from asynccache.errors import ConfigError
from asynccache.storage import redact_reason, redact_uri

__all__ = ["S3Location", "check_endpoint", "parse_s3_uri", "store_endpoint"]

_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_SEGMENT_RE = re.compile(r"[A-Za-z0-9._-]+")
_REGION_RE = re.compile(r"[a-z0-9-]{1,32}")
_IPV4_FORM_RE = re.compile(r"[0-9]+(?:\.[0-9]+){3}")
_QUERY_KEYS = ("endpoint_url", "region")
#: where obstore reads an endpoint from the environment, in the order taken here
_ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT")
#: the spellings of false that obstore accepts for a boolean option such as AWS_ALLOW_HTTP
_FALSE_WORDS = frozenset({"0", "false", "off", "no", "n"})


@dataclass(frozen=True, slots=True, kw_only=True)
class S3Location:
    bucket: str
    prefix: str
    endpoint_url: str | None = None
    region: str | None = None


def parse_s3_uri(uri: str) -> S3Location:
    """Parse and validate ``s3://bucket[/prefix][?endpoint_url=…&region=…]``. The bucket must be
    a name S3 accepts: 3–63 lowercase letters, digits, dots and hyphens, starting and ending with
    a letter or digit, no ``..``, not an IPv4 address."""
    try:
        parts = urlsplit(uri)
        query = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as e:
        raise ConfigError(f"malformed s3 URI {redact_uri(uri)}: {redact_reason(e)}") from None
    if parts.scheme != "s3":
        raise ConfigError(f"not an s3 URI: {redact_uri(uri)}")
    if "@" in parts.netloc or ":" in parts.netloc:
        raise ConfigError(
            f"s3 URI {redact_uri(uri)} carries credentials or a port in its host part; the host part is the "
            "bucket, credentials come from the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
        )
    bucket = parts.netloc
    if _BUCKET_RE.fullmatch(bucket) is None or ".." in bucket or _IPV4_FORM_RE.fullmatch(bucket) is not None:
        raise ConfigError(
            f"s3 URI {redact_uri(uri)}: invalid or missing bucket name {bucket!r} (S3 bucket names: 3-63 "
            "lowercase letters, digits, dots and hyphens, starting and ending with a letter or digit, "
            "no '..', not an IP address)"
        )
    if parts.fragment:
        raise ConfigError(f"s3 URI {redact_uri(uri)} must not have a fragment")
    prefix = parts.path.strip("/")
    for segment in prefix.split("/") if prefix else ():
        if _SEGMENT_RE.fullmatch(segment) is None or segment in (".", ".."):
            raise ConfigError(f"s3 URI {redact_uri(uri)}: invalid prefix segment {segment!r} (use [A-Za-z0-9._-])")
    seen: dict[str, str] = {}
    for key, value in query:
        if key not in _QUERY_KEYS:
            raise ConfigError(
                f"s3 URI {redact_uri(uri)}: unknown parameter {key!r} (known: {list(_QUERY_KEYS)}); "
                "credentials come from the environment, never from the URI"
            )
        if key in seen:
            raise ConfigError(f"s3 URI {redact_uri(uri)}: parameter {key!r} given twice")
        seen[key] = value
    endpoint = seen.get("endpoint_url")
    if endpoint is not None:
        check_endpoint(endpoint, f"s3 URI {redact_uri(uri)}: endpoint_url")
    region = seen.get("region")
    if region is not None and _REGION_RE.fullmatch(region) is None:
        raise ConfigError(f"s3 URI {redact_uri(uri)}: invalid region")
    return S3Location(bucket=bucket, prefix=prefix, endpoint_url=endpoint, region=region)


def check_endpoint(endpoint: str, what: str) -> None:
    """Refuse an endpoint that is not ``http(s)://host[:port]`` without credentials; ``what``
    names where it came from. The message never repeats the endpoint (it may hold credentials)."""
    try:
        ep = urlsplit(endpoint)
        ep.port  # noqa: B018 (parses the port: a bad one raises ValueError)
    except ValueError as e:
        raise ConfigError(f"{what} is malformed or has an invalid port ({redact_reason(e)})") from None
    if ep.scheme not in ("http", "https") or not ep.hostname or "@" in ep.netloc or ep.query or ep.fragment:
        raise ConfigError(f"{what} must be http(s)://host[:port] without credentials")


def store_endpoint(location: S3Location, environ: Mapping[str, str]) -> tuple[str | None, bool | None]:
    """The endpoint the store talks to and whether it may use plain HTTP (``None``: obstore's
    default, ``AWS_ALLOW_HTTP`` when set, else HTTPS only).

    The URI's ``endpoint_url`` comes first; without one, ``AWS_ENDPOINT_URL`` (else
    ``AWS_ENDPOINT``) from ``environ``, checked like the URI's and handed to obstore explicitly
    (obstore reads both names, and with both set which one wins would depend on the environment's
    order). Plain HTTP is allowed exactly when that endpoint's scheme is ``http`` (in any case,
    as a URL's scheme is); an ``http`` endpoint from the environment with ``AWS_ALLOW_HTTP`` set
    to false is a contradiction and raises :class:`ConfigError` (else every request would fail).
    With no endpoint at all the store talks to AWS over HTTPS unless ``AWS_ALLOW_HTTP`` says
    otherwise."""
    if location.endpoint_url is not None:
        return location.endpoint_url, urlsplit(location.endpoint_url).scheme == "http"
    for variable in _ENDPOINT_VARIABLES:
        endpoint = environ.get(variable)
        if endpoint:
            break
    else:
        return None, None
    check_endpoint(endpoint, variable)
    if urlsplit(endpoint).scheme != "http":
        return endpoint, None
    allow = environ.get("AWS_ALLOW_HTTP")
    if allow is not None and allow.strip().lower() in _FALSE_WORDS:
        raise ConfigError(
            f"{variable} is a plain http:// endpoint but AWS_ALLOW_HTTP={allow!r} forbids plain HTTP: "
            "use an https:// endpoint or unset AWS_ALLOW_HTTP"
        )
    return endpoint, True
