package kafkabroker_test

import (
	"context"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/cloudevents/sdk-go/protocol/kafka_sarama/v2"
	"github.com/cloudevents/sdk-go/v2/binding"

	"example.com/patterns/enterprise/outbox/kafkabroker"
	"example.com/patterns/enterprise/outbox/postgres"
)

// What a Publisher with a CloudEvents source sends is read by the
// CloudEvents Go SDK's Kafka binding, over a second, independent Kafka
// client (sarama), into events that validate: the key as id, the type,
// the source, the aggregate as subject, the row's time, the content type
// and the payload as data, JSON and bytes alike. (Caught: the ce_ names
// written as another binding's, which the SDK reads as no event.)
func TestCloudEventsAreReadByTheSDKsKafkaBinding(t *testing.T) {
	ctx := context.Background()
	c := newCluster(t)
	topic := c.topic(1, nil)
	at := time.Date(2026, 12, 7, 9, 0, 0, 0, time.UTC)
	msgs := []postgres.Message{
		{ID: 1, Key: "0b9e1d6a-0000-4000-8000-000000000001", Type: "OrderPlaced", Payload: `{"orderId":1}`, Aggregate: "order/1", Seq: 1, Time: at},
		{ID: 2, Key: "0b9e1d6a-0000-4000-8000-000000000002", Type: "PlanChanged", Payload: string([]byte{0x08, 0x96, 0x01}),
			ContentType: "application/x-protobuf", Time: at},
	}
	publisher := newPublisher(t, c, kafkabroker.PublisherOptions{Topic: topic, CloudEventsSource: "/shop"})
	if n, err := publisher.PublishBatch(ctx, msgs); n != 2 || err != nil {
		t.Fatalf("PublishBatch = %d, %v", n, err)
	}

	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_8_0_0
	consumer, err := sarama.NewConsumer(c.seeds, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer consumer.Close()
	pc, err := consumer.ConsumePartition(topic, 0, sarama.OffsetOldest)
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	for i, want := range msgs {
		var cm *sarama.ConsumerMessage
		select {
		case cm = <-pc.Messages():
		case err := <-pc.Errors():
			t.Fatal(err)
		case <-time.After(time.Minute):
			t.Fatalf("sarama read %d of 2 records within a minute", i)
		}
		event, err := binding.ToEvent(ctx, kafka_sarama.NewMessageFromConsumerMessage(cm))
		if err != nil {
			t.Fatalf("record %d is no CloudEvent to the SDK: %v", i, err)
		}
		if err := event.Validate(); err != nil {
			t.Errorf("record %d: the event does not validate: %v", i, err)
		}
		ct := want.ContentType
		if ct == "" {
			ct = "application/json"
		}
		if event.ID() != want.Key || event.Type() != want.Type || event.Source() != "/shop" || event.Subject() != want.Aggregate ||
			!event.Time().Equal(at) || event.DataContentType() != ct || string(event.Data()) != want.Payload {
			t.Errorf("record %d read as %s; want the message", i, event)
		}
	}
}
