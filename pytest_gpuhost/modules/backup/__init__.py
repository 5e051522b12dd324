"""Backups of a node's files: `local` copies them to a folder (one stream, SHA-256 on both ends).

`manifest` reads what to back up, `destination` gives each target its own folder or S3 prefix,
`listing` is what the node holds, `stream`/`transfer` the bulk stream, `writer` the local side
(a file takes its final name only once both SHA-256 digests agree: the check on arrival),
`verdict` what the backup proves (every path verified, or an item saying why not), `state` the
verified-state journal, and `s3` the upload and the proof of every object.
"""
