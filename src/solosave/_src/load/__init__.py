"""Loading: DCP's load with solosave's reader, whole reads and the read path."""
