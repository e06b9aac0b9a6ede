"""What every layer of cupyconv shares: geometry, dtypes, the device, array kinds, the float64 reference."""
