"""Between ranks: protocol messages, the status word, the Channel (the one door for collectives), rendezvous."""
