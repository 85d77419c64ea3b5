package gate

import (
	"errors"
	"net"
	"os"
	"sync/atomic"
)

// tunnelConn is the client's connection of a paid tunnel, as the gate hands it to the upstream's handler
// (heldResponse.Hijack): it notes whether the client ended the tunnel, that is whether a read from it failed for a
// reason of the client's (its end of the stream, a reset), not because the server closed it. A tunnel its client
// ended was had whole, whatever happens to the configuration after (see callUpstream's unloaded tunnels).
type tunnelConn struct {
	net.Conn
	clientEnded atomic.Bool
	// onClientEnd, when set, is called once, as the client ends the tunnel.
	onClientEnd func()
}

func (c *tunnelConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if err != nil && !errors.Is(err, net.ErrClosed) && !errors.Is(err, os.ErrDeadlineExceeded) &&
		c.clientEnded.CompareAndSwap(false, true) && c.onClientEnd != nil {
		c.onClientEnd()
	}
	return n, err
}

// tunnelConnHalfClose is a tunnelConn of a connection that can close its write half, as reverse_proxy does when
// the upstream ends its side (a TCP connection can).
type tunnelConnHalfClose struct{ *tunnelConn }

func (c tunnelConnHalfClose) CloseWrite() error {
	return c.Conn.(interface{ CloseWrite() error }).CloseWrite()
}

// wrapTunnel is conn as a tunnelConn calling onClientEnd, and the net.Conn to hand over: one that closes its write
// half when conn does.
func wrapTunnel(conn net.Conn, onClientEnd func()) (*tunnelConn, net.Conn) {
	tc := &tunnelConn{Conn: conn, onClientEnd: onClientEnd}
	if _, ok := conn.(interface{ CloseWrite() error }); ok {
		return tc, tunnelConnHalfClose{tc}
	}
	return tc, tc
}
