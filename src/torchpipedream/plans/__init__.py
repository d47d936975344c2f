"""What a plan is: the topology it targets, the schedule kinds it may name, Plan/Stage files, and the memory model that prices them."""
