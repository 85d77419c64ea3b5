package caddymodule

import (
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/facilitatorserver"
)

// resourceCatalog holds the catalog the facilitator handler keeps the bazaar resources in.
type resourceCatalog struct{ facilitatorserver.Catalog }

// useCatalog catalogs the resources of the payments the embedded engine settles in the app's journal: memory,
// bbolt, or the PostgreSQL database every facilitator of a cluster shares, so that they keep one catalog.
func (h *FacilitatorHandler) useCatalog(app *App) {
	store, _, err := app.SettlementJournal()
	if err != nil {
		h.logger.Warn("nothing is catalogued for discovery: the journal did not open", zap.Error(err))
		return
	}
	if d, ok := store.(journal.Discovery); ok {
		h.discovery.Store(resourceCatalog{journal.ResourceCatalog{Store: d}})
	}
}

// catalog is where the bazaar resources are kept, or nil before the journal is open.
func (h *FacilitatorHandler) catalog() facilitatorserver.Catalog {
	if c, ok := h.discovery.Load().(resourceCatalog); ok {
		return c.Catalog
	}
	return nil
}
