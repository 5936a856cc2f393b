"""The pinned releases whose v1 / v2 workers the runtime tests build stand-ins from."""

V1_RELEASES = [
    "0.4.6.post5",
    "0.4.10.post2",
    "0.5.3.post1",
    "0.5.5.post2",
    "0.5.10.post1",
    "0.5.12.post1",
]
V2_RELEASES = [
    "0.5.5.post2",
    "0.5.10.post1",
    "0.5.12.post1",
    "0.5.13.post1",
    "0.5.16",
    "0.5.17",
    "0.5.23",
]
