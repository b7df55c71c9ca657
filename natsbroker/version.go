package natsbroker

// Version is this module's version, the one CHANGELOG.md at the
// repository's root describes: the postgres, natsbroker and rabbitbroker
// modules and the relay process are released together, under one version.
// A copy made by the kit (kit/) keeps it, to say what it was copied from.
const Version = "0.1.0"
