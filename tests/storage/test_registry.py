"""URI registry and URI validation of every scheme."""

from __future__ import annotations

from typing import Any

import pytest
from storage_harness import NAMESPACE

from asynccache.errors import ConfigError
from asynccache.storage import known_schemes, open_backend, register_backend
from storage_backends.local_disk import LocalDiskBackend, parse_file_uri
from storage_backends.memory import MemoryBackend
from storage_backends.object_store import ObjectStoreBackend, parse_s3_uri

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"


async def test_schemes_resolve_to_their_backends(tmp_path: Any) -> None:
    assert {"file", "s3", "memory"} <= set(known_schemes())
    opened = [
        open_backend("memory://", namespace=NAMESPACE),
        open_backend(f"file://{tmp_path}", namespace=NAMESPACE, capacity_bytes=1 << 20, fsync=False),
        open_backend("s3://bucket-name/some/prefix?endpoint_url=http://127.0.0.1:9&region=us-east-1",
                     namespace=NAMESPACE),
    ]
    assert [type(b) for b in opened] == [MemoryBackend, LocalDiskBackend, ObjectStoreBackend]
    for backend in opened:
        await backend.aclose()


def test_unknown_scheme_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown storage scheme 'ftp'.*'file'.*'memory'.*'s3'"):
        open_backend("ftp://host/x", namespace=NAMESPACE)
    with pytest.raises(ConfigError, match="no scheme"):
        open_backend("/just/a/path", namespace=NAMESPACE)


async def test_third_party_backends_register_a_scheme() -> None:
    def factory(uri: str, **options: Any) -> MemoryBackend:
        return MemoryBackend("memory://thirdparty", **options)

    register_backend("thirdparty-test", factory)
    try:
        backend = open_backend("thirdparty-test://x", namespace=NAMESPACE)
        assert isinstance(backend, MemoryBackend)
        await backend.aclose()
        with pytest.raises(ConfigError, match="already registered"):
            register_backend("thirdparty-test", factory)
    finally:
        register_backend("thirdparty-test", "storage_backends.memory:open_memory", replace=True)


BAD_URIS = [
    "file://relative/path",
    "file://otherhost/abs/path",
    "file:///abs/path?capacity_bytes=3",
    "file:///abs/path#frag",
    "file:",
    "memory://name/with/path",
    "memory://?x=1",
    "memory://Bad.Name",
    "s3:///no-bucket",
    "s3://Bad_Bucket/prefix",
    "s3://ab/prefix",
    "s3://a..b/prefix",
    "s3://my..bucket/prefix",
    "s3://192.168.1.1/prefix",
    "s3://10.0.0.255",
    "s3://-bucket/prefix",
    "s3://bucket./prefix",
    "s3://bucket-name/../escape",
    "s3://bucket-name/a//b/./c",
    "s3://bucket-name/prefix?endpoint_url=ftp://host",
    "s3://bucket-name/prefix?endpoint_url=http://user:pw@host:9000",
    "s3://bucket-name/prefix?region=us-east-1&region=eu-west-1",
    "s3://bucket-name/prefix?unknown=1",
    "s3://bucket-name:9000/prefix",
    "s3://bucket-name/prefix#frag",
    "s3://bucket-name/prefix?region=US East",
    "s3://bucket-name/prefix?endpoint_url=http://127.0.0.1:99999",
    "s3://bucket-name/prefix?endpoint_url=http://127.0.0.1:9000:9000",
    "s3://bucket-name/prefix?endpoint_url=http://127.0.0.1:abc",
    "s3://bucket-name/prefix?endpoint_url=http://[::1",
    "file://[::1/var/cache",
    "memory://[::1",
]


@pytest.mark.parametrize("uri", BAD_URIS)
def test_invalid_uris_are_refused(uri: str) -> None:
    with pytest.raises(ConfigError):
        open_backend(uri, namespace=NAMESPACE)


@pytest.mark.parametrize(
    ("parse", "uri"),
    [(parse_s3_uri, "s3://[::1/prefix"), (parse_file_uri, "file://[::1/var/cache"), (MemoryBackend, "memory://[::1")],
)
def test_each_scheme_refuses_a_uri_that_does_not_parse_when_called_directly(parse: Any, uri: str) -> None:
    with pytest.raises(ConfigError, match="malformed"):
        parse(uri)


def test_a_missing_required_option_is_a_config_error(tmp_path: Any) -> None:
    for uri in ("memory://", f"file://{tmp_path}", "s3://bucket-name"):
        with pytest.raises(ConfigError, match="namespace"):
            open_backend(uri)


@pytest.mark.parametrize(
    "uri",
    [
        f"s3://bucket-name/prefix?aws_secret_access_key={SECRET}",
        f"s3://AKIDEXAMPLE:{SECRET}@bucket-name/prefix",
        f"s3://bucket-name/prefix?endpoint_url=http://AKID:{SECRET}@127.0.0.1:9000",
    ],
)
def test_uris_with_credentials_are_refused_without_echoing_them(uri: str) -> None:
    with pytest.raises(ConfigError) as info:
        open_backend(uri, namespace=NAMESPACE)
    assert SECRET not in str(info.value)


def test_s3_uri_parts() -> None:
    loc = parse_s3_uri("s3://bucket-name/a/b.c/d?endpoint_url=https://s3.example.com:8443&region=eu-west-1")
    assert (loc.bucket, loc.prefix, loc.endpoint_url, loc.region) == (
        "bucket-name", "a/b.c/d", "https://s3.example.com:8443", "eu-west-1")
    assert parse_s3_uri("s3://bucket-name").prefix == ""


@pytest.mark.parametrize("bucket", ["abc", "my.bucket-1", "1bucket", "a" * 63, "192.168.1.1x", "1.2.3.4.5"])
def test_s3_bucket_names_s3_accepts_are_accepted(bucket: str) -> None:
    assert parse_s3_uri(f"s3://{bucket}/prefix").bucket == bucket


@pytest.mark.parametrize("bucket", ["a..b", "192.168.1.1", "a" * 64, "Bucket", "bucket_name", "bucket-"])
def test_s3_bucket_names_s3_rejects_are_refused_at_open(bucket: str) -> None:
    with pytest.raises(ConfigError, match="bucket name"):
        ObjectStoreBackend(f"s3://{bucket}/prefix?endpoint_url=http://127.0.0.1:9", namespace=NAMESPACE)


def test_options_are_validated(tmp_path: Any) -> None:
    for options in ({"capacity_bytes": 0}, {"max_concurrency": 0}, {"timeout_s": 0}):
        with pytest.raises(ConfigError):
            open_backend("memory://", namespace=NAMESPACE, **options)
    # Options of the wrong type are refused as such, not taken for something else or left to
    # fail later with an untyped error.
    for uri, option, value in [
        ("memory://", "timeout_s", "30"),
        ("memory://", "timeout_s", None),
        ("memory://", "timeout_s", float("inf")),
        ("memory://", "capacity_bytes", True),
        ("memory://", "max_concurrency", True),
        ("s3://bucket-name", "timeout_s", float("inf")),
        ("s3://bucket-name", "max_retries", None),
        ("s3://bucket-name", "max_retries", 2.5),
        ("s3://bucket-name", "multipart_concurrency", 2.5),
        ("s3://bucket-name", "multipart_part_bytes", "8MiB"),
        (f"file://{tmp_path}", "fsync", "no"),
    ]:
        with pytest.raises(ConfigError, match=option):
            open_backend(uri, namespace=NAMESPACE, **{option: value})
    with pytest.raises(ConfigError, match="namespace"):
        open_backend(f"file://{tmp_path}", namespace="")
    with pytest.raises(ConfigError, match="multipart"):
        open_backend("s3://bucket-name", namespace=NAMESPACE, multipart_part_bytes=1024)
    with pytest.raises(ConfigError, match="does not take"):
        open_backend("memory://", namespace=NAMESPACE, no_such_option=1)
    for name in ("uri", "self"):  # names of the factories' own parameters
        with pytest.raises(ConfigError, match="does not take"):
            open_backend(f"file://{tmp_path}", namespace=NAMESPACE, **{name: "x"})
